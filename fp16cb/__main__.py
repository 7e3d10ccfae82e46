"`python -m fp16cb`: the main job (see `fp16cb.demos.cli`)."
import sys
from .demos.cli import main

if __name__ == '__main__': sys.exit(main())
