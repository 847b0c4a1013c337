"""runs/: the folder a search writes (`rundir`: layout, atomic writes, resume), the HTML pages that show it
(`report`: rendered from `templates/`, with the CSS and JS of `static/` inlined so that a page needs no network), and
one folder merged from several machines' folders of one study (`merge`)."""
