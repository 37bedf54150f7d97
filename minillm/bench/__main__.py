"""`python -m minillm.bench NAME ...`: see minillm.bench."""
from minillm.bench import main

main()
