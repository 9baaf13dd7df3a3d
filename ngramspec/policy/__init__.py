"""The speculation policy, torch-free so that the simulator can replay it: one calibrated acceptance
probability per draft node (the drafter's estimate) against one step-cost curve (`cost.StepCost`),
and the sizing that keeps the drafts that raise expected tokens per second (`sizing`)."""
