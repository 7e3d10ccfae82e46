"`python -m bench` (from the repository root): the benchmark's command line (see `bench.run`)."
from .run import main

if __name__ == '__main__': main()
