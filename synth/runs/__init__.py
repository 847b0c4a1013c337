"""runs/: the folder a search writes (`rundir`: layout, atomic writes, resume) and the HTML pages that show it
(`report`: rendered from `templates/`, with the CSS and JS of `static/` inlined so that a page needs no network)."""
