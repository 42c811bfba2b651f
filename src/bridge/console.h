/* console.h - the console page (web/console/, docs/API.md), embedded into the binary at
 * build time: GET / and its assets come from here, never from the file system, so the
 * binary serves the page it was built with and nothing else.
 *
 * cmake/embed_console.cmake turns every file of web/console/ into a byte array of the
 * generated file build/generated/console_assets.c (no network, no tool beyond CMake); that
 * file defines the table below. This module only looks paths up in it.
 *
 * Ownership: everything returned points into static read-only data.
 * Threads: every function is reentrant. */
#ifndef KVR_BRIDGE_CONSOLE_H
#define KVR_BRIDGE_CONSOLE_H

#include <stddef.h>

/* The Content-Security-Policy to send with every console response: scripts, styles,
 * images and connections only from the server itself, no inline script or style, no
 * frames, plugins or form posts. The page needs nothing else; a browser refuses the rest. */
extern const char kvr_console_csp[];

/* One embedded file, by its URL path ("/console.js"). index.html is also served as "/". */
struct kvr_console_file {
    const char *path;
    const unsigned char *data;
    size_t len;
};

/* The generated table (console_assets.c): kvr_console_n_files entries, sorted by path. */
extern const struct kvr_console_file kvr_console_files[];
extern const size_t kvr_console_n_files;

/* The asset served at `path` (the URL path, without query string): "/" is index.html.
 * Returns 0 with *data, *len and *content_type set (a MIME type with charset for text), or
 * -1 for a path that is not an asset (the caller answers 404). Paths are matched exactly:
 * no "..", no percent-decoding, no directory index other than "/". */
int kvr_console_asset(const char *path, const void **data, size_t *len, const char **content_type);

/* The MIME type for a file name by its extension ("application/octet-stream" if unknown). */
const char *kvr_console_content_type(const char *path);

#endif
