"""Backend modules. Importing one registers its op implementations with dsaquant.dispatch."""
