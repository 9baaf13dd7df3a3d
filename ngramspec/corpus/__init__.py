"""External corpora: file readers, the named registry and the versioned .ngc file format.

Imports no torch and nothing from engine/, server/ or models/.
"""
