"""sweep: a layer of peftune (docs/design.md, "Modules and layers")."""
