"""``python -m overlap_lab.experiments [NAME ...] [--list] [--processes N] [--out DIR] [--draw]``
(also ``overlap-lab experiments ...``): run the declared experiments (all, or those named) and
write their results into ``--out`` (default ``./overlap-lab-results/``)."""

from overlap_lab.experiments.runner import main

if __name__ == "__main__":
    raise SystemExit(main())
