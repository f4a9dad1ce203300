"""`python -m bench.learning EXPERIMENT ...`: the same as `python -m bench learning ...`."""

from bench.learning import main

if __name__ == "__main__":
    main()
