"""The cpu backend. Registered through the `portside.platforms` entry point like any plugin."""


def register() -> str:
    # Every machine has a CPU; availability details come from CpuPlatform.is_available().
    return "portside.backends.cpu.platform:CpuPlatform"
