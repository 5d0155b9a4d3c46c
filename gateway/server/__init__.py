"""The regional gateway server: routes, version store, relays, registry, statements."""
