"""``python -m meshplan``: the console script ``meshplan`` (:func:`meshplan.cli.main`)."""

from meshplan.cli import main

if __name__ == "__main__":
    main()
