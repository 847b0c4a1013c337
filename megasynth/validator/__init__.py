"""Static validator for megakernel schedules: format, structure, coverage, deadlock and race proofs (no torch)."""

from megasynth.ir.errors import ScheduleError
from megasynth.ir.schedule import FORMAT, Schedule, load_schedule, loads_schedule, parse_schedule

__all__ = ["FORMAT", "Schedule", "ScheduleError", "load_schedule", "loads_schedule", "parse_schedule"]
