"""``python -m overlap_lab.cli``: the ``overlap-lab`` command without the installed script (as
``torchrun -m overlap_lab.cli run ...`` launches it on several GPUs)."""

import sys

from overlap_lab.cli.main import main

sys.exit(main())
