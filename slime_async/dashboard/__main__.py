from slime_async.dashboard.serve import main

main()
