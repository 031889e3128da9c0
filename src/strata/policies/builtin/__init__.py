"""The built-in policies, each registered by its own plugin module through the package's
`strata` entry points (setup.cfg), as an outside package registers its own."""
