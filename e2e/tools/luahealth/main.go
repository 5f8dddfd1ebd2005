// lua-health runs an Argo CD resource health script in gopher-lua, the Lua 5.1 interpreter Argo CD
// embeds, the way Argo CD does: the object is a global `obj` (JSON maps -> tables, arrays -> 1-based
// tables), the script's returned table is the health status.
//
// Usage: lua-health SCRIPT.lua < objects.json     (a JSON array of objects)
// Prints a JSON array with one {"status": ..., "message": ...} (or {"error": ...}) per object.
package main

import (
	"encoding/json"
	"fmt"
	"os"

	lua "github.com/yuin/gopher-lua"
)

type health struct {
	Status  string `json:"status,omitempty"`
	Message string `json:"message,omitempty"`
	Error   string `json:"error,omitempty"`
}

// toLua converts decoded JSON to Lua values (as Argo CD's decodeValue does).
func toLua(l *lua.LState, v any) lua.LValue {
	switch x := v.(type) {
	case map[string]any:
		t := l.NewTable()
		for k, item := range x {
			t.RawSetString(k, toLua(l, item))
		}
		return t
	case []any:
		t := l.NewTable()
		for _, item := range x {
			t.Append(toLua(l, item))
		}
		return t
	case json.Number:
		f, _ := x.Float64()
		return lua.LNumber(f)
	case string:
		return lua.LString(x)
	case bool:
		return lua.LBool(x)
	default:
		return lua.LNil
	}
}

func run(script string, obj any) health {
	// Only the libraries Argo CD opens for health scripts (no io, no os).
	l := lua.NewState(lua.Options{SkipOpenLibs: true})
	defer l.Close()
	for _, lib := range []struct {
		name string
		open lua.LGFunction
	}{{lua.LoadLibName, lua.OpenPackage}, {lua.BaseLibName, lua.OpenBase}, {lua.TabLibName, lua.OpenTable},
		{lua.StringLibName, lua.OpenString}, {lua.MathLibName, lua.OpenMath}} {
		l.Push(l.NewFunction(lib.open))
		l.Push(lua.LString(lib.name))
		l.Call(1, 0)
	}
	l.SetGlobal("obj", toLua(l, obj))
	if err := l.DoString(script); err != nil {
		return health{Error: err.Error()}
	}
	t, ok := l.Get(-1).(*lua.LTable)
	if !ok {
		return health{Error: fmt.Sprintf("the script returned %s, not a table", l.Get(-1).Type())}
	}
	return health{Status: lua.LVAsString(t.RawGetString("status")), Message: lua.LVAsString(t.RawGetString("message"))}
}

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: lua-health SCRIPT.lua < objects.json")
		os.Exit(2)
	}
	script, err := os.ReadFile(os.Args[1])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	dec := json.NewDecoder(os.Stdin)
	dec.UseNumber()
	var objs []any
	if err := dec.Decode(&objs); err != nil {
		fmt.Fprintln(os.Stderr, "stdin must be a JSON array of objects:", err)
		os.Exit(2)
	}
	out := make([]health, len(objs))
	for i, obj := range objs {
		out[i] = run(string(script), obj)
	}
	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		os.Exit(1)
	}
}
