"""runs/: the folder a search writes (`rundir`: layout, atomic writes, resume) and the HTML pages that show it
(`report`)."""
