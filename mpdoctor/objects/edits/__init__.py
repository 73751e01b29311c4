"""Reversible, in-place edits of live objects: the executable steps every fix is made of."""
