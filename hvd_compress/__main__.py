"""`python -m hvd_compress [options] SCRIPT ARGS...`: hvd_compress.launch."""
from .launch import main

main()
