"""Tool packs: the registry, the demo pack and the conformance fixture pack."""
