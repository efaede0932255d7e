"""The rank harness of the capture, train and eval entry points, and the environment check of the machine they run
on."""
