"""The `synth` subcommands that live outside synth/cli.py, one module each (search, bench + generate, runs,
calibrate); synth.cli attaches them, and one whose third-party package is missing becomes a stand-in."""
