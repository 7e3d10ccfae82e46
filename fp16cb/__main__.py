"`python -m fp16cb`: the main job (see `fp16cb.demo`)."
import sys
from .demo import main

if __name__ == '__main__': sys.exit(main())
