"""`python -m trl_tlt.tooling.workload`: build (or load) the embedded policy and describe it."""

from .evaluate import main


main()
