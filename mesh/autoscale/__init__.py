"""The rollout autoscaler: a control loop that reads the broker's balance report and resizes the
rollout pool through a launcher (`LocalLauncher` for pool processes on this machine,
`CommandLauncher` for a configured command that asks Kubernetes, Slurm or a cloud API for a count),
within bounds and with a cooldown between changes.
"""
