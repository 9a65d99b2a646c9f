"""The documents the ``search`` service indexes (a package only so that they ship as package data)."""
