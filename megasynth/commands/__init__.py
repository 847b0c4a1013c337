"""The `synth` subcommands that live outside megasynth/cli.py, one module each (search, bench + generate, runs,
calibrate); megasynth.cli attaches them, and one whose third-party package is missing becomes a stand-in."""
