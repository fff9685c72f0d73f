"""Tooling that ships beside the library: CLI commands, the embedded workload and demo, simulators, tiny models.

The library (everything else under `trl_tlt/`) never imports from here.
"""
