"""Step monitors and their remedies: the spike guard, weight-growth monitoring, fault triage."""
