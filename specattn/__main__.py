"""``python -m specattn`` runs the ``specattn`` command line (see :mod:`specattn.cli`)."""
from specattn.cli import main

if __name__ == "__main__":
    main()
