"""vfgraph's version, in a module of its own so that every other module can name it without
importing the package's API (``from vfgraph.version import __version__``)."""

__version__ = "0.1.0"
