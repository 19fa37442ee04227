"""KV connectors: moving KV-cache blocks between the device cache and somewhere else (host memory,
disk, a shared directory, another instance). Pure Python here (the scheduler's half); the
worker's half is `portside.runner.kv_transfer`. The contract is `portside.kv_transfer.base`."""
