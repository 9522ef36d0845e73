from chatctx.cli import main

main()
