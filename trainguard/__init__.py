"""trainguard's control side: the GuardedTrainingJob spec, the recovery policy and the local runner."""
