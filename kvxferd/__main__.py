from ._daemon import main

main()
