// One binary for the Kubernetes components the e2e cluster runs, dispatched on the name it is
// called by (kube-apiserver, kube-controller-manager, kube-scheduler, kubectl are links to it).
// Linking the shared dependency graph once instead of four times saves minutes on a 2-core build.
package main

import (
	"fmt"
	"os"
	"path/filepath"

	"github.com/spf13/cobra"
	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
	kubectl "k8s.io/kubectl/pkg/cmd"
	kubectlutil "k8s.io/kubectl/pkg/cmd/util"
	_ "time/tzdata"
)

func main() {
	name := filepath.Base(os.Args[0])
	if name == "kube" && len(os.Args) > 1 {
		// `kube kube-apiserver --flags...` works too.
		name = os.Args[1]
		os.Args = os.Args[1:]
	}
	var command *cobra.Command
	switch name {
	case "kube-apiserver":
		command = apiserver.NewAPIServerCommand()
	case "kube-controller-manager":
		command = controllermanager.NewControllerManagerCommand()
	case "kube-scheduler":
		command = scheduler.NewSchedulerCommand()
	case "kubectl":
		// Same as upstream cmd/kubectl: errors are printed by CheckErr, not by cobra.
		if err := cli.RunNoErrOutput(kubectl.NewDefaultKubectlCommand()); err != nil {
			kubectlutil.CheckErr(err)
		}
		return
	default:
		fmt.Fprintf(os.Stderr, "kube: unknown component %q (want kube-apiserver, kube-controller-manager, kube-scheduler or kubectl)\n", name)
		os.Exit(2)
	}
	os.Exit(cli.Run(command))
}
