"""In-process doubles of the loop's and the session's ports, and a scripted model server."""
