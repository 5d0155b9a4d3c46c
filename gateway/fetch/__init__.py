"""The verified fetcher that relays and pools share: sources, links, lanes, hedging, plan steps."""
