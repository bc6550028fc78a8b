"""Backend modules. Importing one registers its implementations with :mod:`atom_kernels.registry`;
the table of modules is :data:`atom_kernels.registry.BACKEND_MODULES`."""
