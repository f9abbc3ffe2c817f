"""Front doors: the Python API and the command line."""
