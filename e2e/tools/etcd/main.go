// etcd's own main (go.etcd.io/etcd/v3 main.go) is a one-liner over etcdmain; the server module's
// go.mod has local replace directives, so it cannot be `go install`ed directly.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
