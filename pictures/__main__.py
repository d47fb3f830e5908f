"""python -m pictures loss|schedule|memory ...: pictures/draw.py's command line."""
from pictures.draw import main

main()
