"""What ships beside the library: the CLI commands, the embedded workload and demo, the simulators, tiny offline
models. The library (everything else under `trl_tlt/`) never imports from here."""
