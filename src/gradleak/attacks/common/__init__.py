"""Code shared by several attack families (docs/DESIGN.md §2): subspace tests, label inference, local-step simulation,
gradient capture. Nothing here registers an attack; a family imports what it needs from here, never from another
family's module."""
