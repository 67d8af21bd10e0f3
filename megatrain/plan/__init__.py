"""Memory planning: host and GPU bytes of a Placement or Program. Reads model/ and ir/ only."""
