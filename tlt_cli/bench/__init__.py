"""`tlt bench`: the benchmarks of tlt as a few subcommands over one shared module (tlt_cli/bench/common.py).

    tlt bench rollout --recipe my.yaml      # whether and how much SD pays in this machine's rollouts
    tlt bench costs --recipe my.yaml        # what a plain step and a verify pass cost, rows x tokens
    tlt bench runs --recipe my.yaml         # end-to-end `tlt train` runs: variants x seeds

Each prints one table and writes JSON (`--out`) naming the machine it ran on.
"""
