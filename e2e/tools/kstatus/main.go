// kstatus judges objects with sigs.k8s.io/cli-utils' kstatus (what Flux's health checks and kpt use):
// Current, InProgress, Failed, Terminating, NotFound or Unknown, with kstatus' own message.
//
// Usage: kstatus < objects.json     (a JSON array of objects, e.g. `kubectl get -o json`'s items)
// Prints a JSON array with one {"status": ..., "message": ...} (or {"error": ...}) per object.
package main

import (
	"encoding/json"
	"fmt"
	"os"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/cli-utils/pkg/kstatus/status"
)

type result struct {
	Status  string `json:"status,omitempty"`
	Message string `json:"message,omitempty"`
	Error   string `json:"error,omitempty"`
}

func main() {
	var objs []map[string]any
	if err := json.NewDecoder(os.Stdin).Decode(&objs); err != nil {
		fmt.Fprintln(os.Stderr, "stdin must be a JSON array of objects:", err)
		os.Exit(2)
	}
	out := make([]result, len(objs))
	for i, obj := range objs {
		// Round-trip through unstructured's own JSON decoding so numbers are int64 as from the API.
		raw, _ := json.Marshal(obj)
		u := &unstructured.Unstructured{}
		if err := u.UnmarshalJSON(raw); err != nil {
			out[i] = result{Error: err.Error()}
			continue
		}
		res, err := status.Compute(u)
		if err != nil {
			out[i] = result{Error: err.Error()}
			continue
		}
		out[i] = result{Status: res.Status.String(), Message: res.Message}
	}
	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		os.Exit(1)
	}
}
