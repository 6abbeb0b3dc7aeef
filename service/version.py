"""The release of kda-serve: `kda-serve --version`, ``GET /info``'s ``version`` and the
package metadata (pyproject.toml reads it from here) say the same."""

__version__ = "0.1.0"
