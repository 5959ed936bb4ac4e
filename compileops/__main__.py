"""``python -m compileops``: compile a small model per op family and print a health report."""
import sys

from compileops._selfcheck import main

if __name__ == "__main__":
    sys.exit(main())
