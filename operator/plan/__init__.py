"""Pure decisions: the spec parsed, the model profile, the sizing plan, the replica count, the conditions."""
