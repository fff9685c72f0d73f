"""Are the embedded builds deterministic here? Build the policy, its EAGLE-3 head, the drift policy and its head into
a fresh cache and compare their checksums with another cache's (by default the one `make demo` uses).

    python scripts/tools/check_builds.py --output docs/benchmarks/builds_cpu.json     (about 20 min on 2 cores)
"""

import argparse
import tempfile
from pathlib import Path

from trl_tlt.tooling.benchmarks import write_json  # first: the Hugging Face libraries offline


# isort: split


from trl_tlt.tooling.workload import build_drift_policy, build_eagle3_drafter, build_policy  # noqa: E402
from trl_tlt.tooling.workload.builds import BUILD_THREADS, build_checksum, default_cache_dir  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fresh-cache", default=None, help="Where to build (default: a new temporary folder).")
    parser.add_argument("--against", default=str(default_cache_dir()), help="The cache to compare with.")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    fresh = args.fresh_cache or tempfile.mkdtemp(prefix="trl-tlt-builds-")
    paths = [
        build_policy(cache_dir=fresh),
        build_eagle3_drafter(cache_dir=fresh),
        *build_drift_policy(cache_dir=fresh),
    ]
    builds = {}
    for path in paths:
        other = Path(args.against) / path.name
        builds[path.name] = {"fresh": build_checksum(path), "other": build_checksum(other) if other.exists() else None}
    result = {
        "benchmark": "builds",
        "build_threads": BUILD_THREADS,
        "against": args.against,
        "builds": builds,
        "identical": all(b["fresh"] == b["other"] for b in builds.values()),
    }
    print(result)
    write_json(result, args.output)


if __name__ == "__main__":
    main()
