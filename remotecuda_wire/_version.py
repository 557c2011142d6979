"""The one place the version is written: pyproject.toml reads it (hatch's version source),
and ``remotecuda``, the gateway and the kernel import it. Free of imports, so that reading the
version never imports torch."""
__version__ = "0.1.0"
