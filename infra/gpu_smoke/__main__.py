import sys

from infra.gpu_smoke.cli import main

sys.exit(main())
