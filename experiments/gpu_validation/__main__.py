"""``python -m overlap_lab.experiments.gpu_validation``: the loop's command line."""

from overlap_lab.experiments.gpu_validation.driver import main

raise SystemExit(main())
